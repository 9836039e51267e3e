"""`RankCore`'s progress: the synthetic pattern (S2), the poll loop (posted
chunks polled to DONE or ERR, NIXL notifications drained, deadlines
ticked), and what requests end in: outcomes and their waiters, stats and
metrics.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kvhandoff.actors._dataplane import Chunk, XferState
from kvhandoff.actors._frames import NixlNotifChannel
from kvhandoff.actors._metrics import failed as metrics_failed
from kvhandoff.actors._metrics import resident_bytes
from kvhandoff.actors._pattern import expected_blocks, request_seed
from kvhandoff.actors.rank._config import log
from kvhandoff.actors.rank._state import _RankState
from kvhandoff.protocol import (
    ContextTicket,
    DecodeError,
    LocalOutcome,
    ParentKey,
    ProtocolError,
    decode_stage,
)
from kvhandoff.protocol import summary as negotiation_summary

_T = TypeVar("_T")

#: How long after a READ is posted the poll loop only yields instead of
#: sleeping `poll_interval_s`: a READ of host memory ends in tens of µs (of
#: 1 MiB, ~0.2 ms), and a whole interval's wait sat on every pulled
#: handoff's path (docs/vllm.md).
HOT_AFTER_POST_S = 0.001


async def _answer(
    waiters: dict[ParentKey, list[asyncio.Future[_T]]], parent: ParentKey, timeout: float, shield: bool = False
) -> _T | None:
    """The answer to a future listed under ``waiters[parent]`` (whoever
    answers pops the list), or None once ``timeout`` passed: the future is
    unlisted then, and ``parent`` with its last one. ``shield``: a timeout
    leaves the future itself uncancelled."""
    future: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
    waiters.setdefault(parent, []).append(future)
    try:
        return await asyncio.wait_for(asyncio.shield(future) if shield else future, timeout)
    except TimeoutError:
        waiting = waiters.get(parent, [])
        if future in waiting:
            waiting.remove(future)
        if not waiting:
            waiters.pop(parent, None)
        return None


class _Polling(_RankState):
    """The poll loop, outcomes and stats (a concern of `RankCore`)."""

    # -- synthetic prefill (CTX) and verification (GEN): S2 ------------------------------

    def _pattern(self, parent: ParentKey, rank: int, n: int) -> torch.Tensor:
        layout = self.config.layout
        return expected_blocks(
            request_seed(parent.request_id, parent.ctx_attempt),
            num_layers=layout.num_layers,
            local_heads=self.local_heads,
            head_offset=rank * self.local_heads,
            tokens_per_block=layout.tokens_per_block,
            row_bytes=layout.head_dim * layout.dtype_bytes,
            first_block=0,
            num_blocks=n,
        )

    # -- the poll loop -----------------------------------------------------------------------

    def _ensure_polling(self) -> None:
        self._wake.set()
        if self._poll_task is None or self._poll_task.done():
            self._poll_task = asyncio.get_running_loop().create_task(self._poll_loop())

    #: `_ensure_polling` under the name the staged data plane calls it by
    #: (actors/_stager.py `WriterHost`).
    ensure_polling = _ensure_polling

    @property
    def channel(self) -> NixlNotifChannel:
        """The channel every NIXL notification of this rank is drained from and
        sent on (the staged reader sends its ACKs on it: `ReaderHost`)."""
        return self._channel

    async def _poll_loop(self) -> None:
        """Poll posted chunks to DONE/ERR and tick deadlines. Reports results only."""
        last_expire = 0.0
        last_progress = 0.0
        idle_sweeps = 0  # sweeps in a row where no chunk finished: back off
        while True:
            try:
                now = time.monotonic()
                progressed = self._poll_chunks(now)
                # Drains notifications (frames, staging notices) and progresses
                # our NIXL worker: agents run without a progress thread.
                for _, frame in self._channel.poll():
                    progressed = True
                    if self._notif is not None:
                        await self._receive_frame(frame, "notif")
                    else:
                        self.counters["nixl_frames_unexpected"] += 1
                staged = self._channel.stage_sink
                while staged:
                    progressed = True
                    sender, payload = staged.pop(0)
                    self._on_stage(sender, payload, time.monotonic())
                if now - last_expire > 0.05:
                    last_expire = now
                    self._perform(self.side.expire(now))
                    self._replay_parked()  # a lease that ran out before its apply came
                    if self.metrics.due(now):
                        self._export_metrics(now)
                idle_sweeps = 0 if progressed else idle_sweeps + 1
                if (self._notif is not None and self.side.any_live()) or self._stage_polling():
                    # Frames arrive only when polled: poll at the short interval
                    # while a request is live (an empty poll costs a few µs). On
                    # a GPU, a chunk takes ~0.1 ms: within 2 ms of the last
                    # progress the loop only yields (a burst), then backs off.
                    if progressed:
                        last_progress = now
                    hot = (self._hot and now - last_progress < 0.002) or now - self._posted_at < HOT_AFTER_POST_S
                    await asyncio.sleep(0 if hot else self.config.poll_interval_s)
                elif self._chunks_in_flight():
                    # Stuck chunks (e.g. of a quarantined lease) are kept and polled, never
                    # released: back off from 0.5 ms to 50 ms so they cost no CPU.
                    await asyncio.sleep(min(self.config.poll_interval_s * (1 << min(idle_sweeps // 64, 7)), 0.05))
                else:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), timeout=0.25)
            except Exception:
                # A sweep that raised is a bug (a transport or the protocol
                # broke a promise): count it, say it, and keep polling. A
                # dead loop would leave every chunk and frame of this rank
                # unpolled, each request to its watchdog.
                self._poll_failed()
                await asyncio.sleep(self.config.poll_interval_s)

    def _poll_posted(
        self,
        in_flight: dict[tuple[ContextTicket, int], Chunk],
        now: float,
        on_done: Callable[[ContextTicket, Chunk], None] | None = None,
    ) -> bool:
        """Poll the chunks this rank posted (`in_flight`: CTX WRITEs, GEN
        READs) and tell the protocol of each that reached DONE or ERR; only
        then is its handle released (releasing a running transfer is no
        abort). `on_done` sees each DONE chunk first. Returns whether any ended."""
        progressed = False
        for key, chunk in list(in_flight.items()):
            state = chunk.poll()
            if state is XferState.PROC or state is XferState.PENDING:
                continue
            progressed = True
            del in_flight[key]
            chunk.release()
            ticket, index = key
            try:
                if state is XferState.DONE:
                    if on_done is not None:
                        on_done(ticket, chunk)
                    actions = self.side.chunk_done(ticket, index, chunk.nbytes, now)
                else:
                    actions = self.side.chunk_failed(ticket, index, now, chunk.descriptors)
            except ProtocolError as exc:
                self.counters[f"poll_{type(exc).__name__}"] += 1
                continue
            self._perform(actions)
        return progressed

    def _poll_failed(self) -> None:
        self.counters["poll_loop_errors"] += 1
        if self.counters["poll_loop_errors"] == 1 or self.counters["poll_loop_errors"] % 1000 == 0:
            log.exception(
                "rank %s: a poll sweep raised (%d so far); the loop goes on",
                self.ns, self.counters["poll_loop_errors"],
            )

    def _on_stage(self, sender: str, payload: bytes, now: float) -> None:
        """A staging notice (a WRITE's, or an ACK) drained from NIXL."""
        try:
            notice = decode_stage(payload)
        except DecodeError as exc:
            self.counters["staged_undecodable"] += 1
            log.warning("rank %s: undecodable staging notice from %s: %s", self.ns, sender, exc)
            return
        take = self._stage_takers.get(type(notice))
        if take is None:  # not for this role's staged end, or the rank has none
            self.counters["staged_misdirected"] += 1
        else:
            take(sender, notice, now)

    def _stage_polling(self) -> bool:
        """Whether to poll at the short interval because staging notices are
        due (the roles say when; agents run without a progress thread, which
        spun a core per rank: a WRITE target progresses in this loop)."""
        return False

    # -- outcomes, stats -------------------------------------------------------------------------

    def _finish(self, parent: ParentKey, outcome: LocalOutcome) -> None:
        """`parent` reached a local outcome: answer its waiters and drop the
        per-request bookkeeping (a long-running rank must not grow with traffic).
        The first outcome recorded wins (e.g. "failed" from byte verification over
        the protocol's "cancelled" for the round's decided failure). Outcomes
        themselves are remembered, boundedly, for late `wait` calls."""
        outcome = self._outcome.setdefault(parent, outcome, time.monotonic())
        for future in self._waiters.pop(parent, []):
            if not future.done():
                future.set_result(outcome)
        self._tokens.pop(parent, None)
        peer = self._pair_of.pop(parent, None)
        if peer is not None:
            pair = self._pairs.get(peer)
            if pair is not None and pair.left:
                self._drop_pair(peer)  # unloads once no parent with it is live
        self._forget(parent)

    async def wait(self, parent: ParentKey, timeout: float, absent: str | None = None) -> LocalOutcome | str:
        """Wait until `parent` reaches a local outcome (a `LocalOutcome`: completed,
        cancelled, ...; a str, so it compares with the plain strings), or "timeout".

        A parent this rank has never heard of and has no outcome for waits too
        (its admission or OPEN may still be on the way); `timeout` bounds it.
        A caller that knows no admission is on the way any more (the decision
        that ended it was applied here) passes `absent`: the answer for a
        parent this rank never held."""
        self._ensure_polling()
        if absent is not None and not self.side.is_live(parent) and parent not in self._outcome:
            return absent
        if parent in self._outcome and self.side.at_rest(parent):
            return self._outcome[parent]
        outcome = await _answer(self._waiters, parent, timeout)
        return "timeout" if outcome is None else outcome

    async def returned(self, parent: ParentKey, timeout: float) -> bool:
        """Wait until this rank holds none of `parent`'s blocks any more: True
        once they are back in the pool (released, or reclaimed from
        quarantine with a proof of quiescence), False if `timeout` passed
        first (e.g. they are quarantined). An engine reuses its blocks only
        after this answered True on every rank that held them. A parent this
        rank does not hold answers True at once: ask after its outcome."""
        if not self.pool.holds(parent):
            return True
        answer = await _answer(self._returns, parent, timeout, shield=True)
        return bool(answer)

    async def stats(self) -> dict[str, Any]:
        self.pool.check_invariants()  # S4: raises if a block is in two states
        counts = self.pool.counts()
        states = collections.Counter(s.value for s in self.side.parents().values())
        now = time.monotonic()
        return {
            "role": self.role.value,
            "rank": self.config.rank,
            "epoch": self.our.epoch,
            "agent": self.transport.name,
            "free": counts.free,
            "leased": counts.leased,
            "quarantined": counts.quarantined,
            "reclaimed": self.counters.get("reclaimed_blocks", 0),
            "admission_stopped": self.side.admission_stopped(),
            "pool": self.config.pool_blocks,
            "parents": dict(states),
            "in_flight_chunks": self._chunks_in_flight(),
            "posted_chunks": self.transport.posted_chunks,
            "posted_bytes": self.transport.posted_bytes,
            "leaked_handles": len(self.transport.leaked),
            "unproven_chunks": len(self.transport.unproven),
            # Per-request bookkeeping of requests still in progress: empty when idle.
            "tracking": len(self._tokens) + len(self._waiters) + len(self._returns) + self._tracking(),
            "counters": dict(self.counters),
            "frames": self.config.frames,
            "streams_open": self._streams.open_count() if self._streams is not None else 0,
            "violations": list(self.violations),
            "negotiated": negotiation_summary(self._negotiation),
            "pairs": {i: negotiation_summary(p.negotiation) for i, p in self._pairs.items()},
            "conservative": self._conservative(),
            "staging": self._staging_stats(),
            "quarantine": self._quarantine_detail(),
            "memory": {
                "resident_bytes": resident_bytes(),
                "outcomes": self._outcome.stats(now),
                **self._remembered(),
            },
            # CPU seconds this process spent so far, every thread (Ray's too).
            "cpu_s": time.process_time(),
        }

    def _remembered(self) -> dict[str, Any]:
        """Role-specific bounded memories (`RecentMemory.stats()`), for `stats()`."""
        return {}

    def _quarantine_detail(self, limit: int = 8) -> list[dict[str, Any]]:
        """The quarantined parents held here (the first `limit`): the peer
        instance each pairs with and every edge's evidence, so a report
        says whose proof is still missing."""
        out: list[dict[str, Any]] = []
        for parent in self.side.quarantined_parents():
            if len(out) == limit:
                break
            edges = [
                [f"ctx{t.ctx.ns.rank}.e{t.ctx.epoch}", f"gen{t.gen.ns.rank}.e{t.gen.epoch}", e.state.value,
                 len(e.in_flight), e.terminal.value if e.terminal is not None else None]
                for t, e in self.side.edges(parent).items()
            ]
            out.append({"request_id": parent.request_id, "peer": self._pair_of.get(parent), "edges": edges})
        return out

    def _staging_stats(self) -> dict[str, Any]:
        out = {"mode": self.config.data_mode, "arena_slots": self.arena.slots if self.arena is not None else 0}
        if self._staged is not None:
            out.update(self._staged.stats())
        return out

    def _export_metrics(self, now: float) -> None:
        """Export the pool gauges and the growth of our counters through Ray
        (actors/_metrics.py); never raises into the protocol."""
        try:
            counts = self.pool.counts()
            staged = self._staging_stats().get("counters", {})
            counters = dict(self.counters)
            # Push: a CTX rank posts the WRITEs, a GEN rank receives them; the
            # other role's term is 0. Staged: CTX posts slots, GEN scatters them.
            counters["moved_bytes"] = self.transport.posted_bytes + self.counters["bytes_received"]
            counters["staged_chunks"] = staged.get("staged_chunks", 0) + staged.get("scattered", 0)
            counters["slots_quarantined"] = staged.get("slots_quarantined", 0)
            self.metrics.export(
                now,
                free=counts.free,
                leased=counts.leased,
                quarantined=counts.quarantined,
                pool=counts.total,
                admission_stopped=self.side.admission_stopped(),
                counters=counters,
            )
        except Exception as exc:
            metrics_failed(f"rank {self.ns}", exc)

    async def buffer_base(self) -> int:
        return self.buffer.base

    async def ping(self) -> int:
        """One Ray actor round trip (the control-plane yardstick)."""
        return self.config.rank
