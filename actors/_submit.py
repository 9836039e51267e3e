"""Submissions batched per coordinator: `Submitter`, `SubmitRequest`, `SubmitAnswer`.

Theory of operation
-------------------
A Ray actor call costs both processes most of a millisecond of CPU on a busy
host, whatever it carries (docs/design.md "Submissions in batches"); one
call per handoff made the client's `submit` the largest single cost of a
small handoff, at the client and at the GEN coordinator alike. A client
with many handoffs in flight submits them together instead:

- **Batch.** The submissions a client makes to one coordinator in one turn
  of its event loop go in one call, `submit_many`, sent at the end of that
  turn. Nothing waits for a batch to fill or for an earlier one to return:
  a lone submission goes at once, as the plain `submit` call.
- **Answers.** `submit_many` is a Ray streaming generator: at each decision
  that ends some of the batch's handoffs, the coordinator yields their
  answers, and each caller's future is resolved as its answer comes. A
  small handoff never waits for a big one of the same batch.
- **Refusals.** Each request is checked and queued on its own. One that
  `submit` would refuse (a bad request, a parent already in flight, a
  draining instance) is answered with that error, which its caller's
  future raises; the others of the batch go on.
- **Loss.** If the call fails (the coordinator died), every caller of the
  batch not yet answered gets the call's error, as its own `submit` call
  would have raised it.
- **Channel.** Where the coordinator serves client channels (its instance's
  frames go by stream: actors/_coordinator_clients.py), the first
  submission to it also asks for its address (`submit_address`) and opens
  a TCP connection (actors/_channel.py); from then on each submission is one
  `submit` message on it, those of one turn of the loop in one send, and
  its answer comes back on it: the outcome, or the error `submit` raises,
  of the same type. Until the connection is open, and for good once it
  could not open or broke, submissions go by Ray call as above. When it
  breaks (the coordinator's process ended), every submission waiting on it
  fails with `ConnectionError`, as a Ray call to a dead actor fails.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple

import msgspec

from kvhandoff.actors._channel import CallChannel, connect
from kvhandoff.protocol import ParentKey

__all__ = ["SubmitAnswer", "SubmitRequest", "Submitter"]

log = logging.getLogger("kvhandoff.submit")


class SubmitRequest(NamedTuple):
    """One handoff of a `submit_many` batch: the arguments of `submit`."""

    parent: ParentKey
    num_tokens: int
    release_when_ready: bool = False
    blocks: tuple[int, ...] = ()
    peer_instance: str = ""


class SubmitAnswer(NamedTuple):
    """The answer to request `index` of a batch: its outcome, or the error
    its own `submit` would have raised."""

    index: int
    outcome: str | None = None
    error: BaseException | None = None


Spawn = Callable[[Coroutine[Any, Any, None]], Any]


class Submitter:
    """A client's submissions, batched per coordinator (module docstring).

    `spawn(coroutine)` runs a task the client owns (its shutdown cancels it;
    without one, the submitter keeps its tasks itself); `counters` counts
    calls and requests, for the client's stats."""

    def __init__(self, spawn: Spawn | None = None) -> None:
        self._spawn: Spawn = spawn or self._keep
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: dict[Any, list[tuple[SubmitRequest, asyncio.Future[str]]]] = {}
        #: Per coordinator handle: its open channel, `_OPENING`, or None (Ray
        #: calls: it serves none, it could not open, or it broke).
        self._channels: dict[Any, Any] = {}
        self._closed = False
        self.counters = {"submit_calls": 0, "submit_batches": 0, "submitted": 0, "submit_channel": 0}
        #: What the channels count (sends, calls, failures to open).
        self.channel_counters: collections.Counter[str] = collections.Counter()

    def submit(self, coordinator: Any, request: SubmitRequest) -> asyncio.Future[str]:
        """Submit `request` to `coordinator` (a GEN coordinator's actor
        handle); the future is its outcome, or raises what `submit` raises."""
        channel = self._channel(coordinator)
        sent = channel.call("submit", (request,), _OUTCOME) if channel is not None else None
        future: asyncio.Future[str] = sent if sent is not None else asyncio.get_running_loop().create_future()
        # A caller that stopped waiting (a timeout over a shield) leaves its
        # future's error unread: read here, so asyncio does not log it.
        future.add_done_callback(_read_error)
        self.counters["submitted"] += 1
        if sent is not None:
            self.counters["submit_channel"] += 1
            return future
        batch = self._pending.get(coordinator)
        if batch is None:
            batch = self._pending[coordinator] = []
            asyncio.get_running_loop().call_soon(self._flush, coordinator)
        batch.append((request, future))
        return future

    def has_channel(self, coordinator: Any) -> bool:
        """Is a channel to `coordinator` open (its submissions go on it)? If
        none was asked for yet, this starts opening one."""
        return self._channel(coordinator) is not None

    def close(self) -> None:
        """Close every channel (the client shuts down): submissions still
        waiting on one fail with `ConnectionError`."""
        self._closed = True
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            if isinstance(channel, CallChannel):
                channel.close()

    def _channel(self, coordinator: Any) -> CallChannel | None:
        """The open channel to `coordinator`, if any; the first call starts opening one."""
        state = self._channels.get(coordinator, _UNASKED)
        if isinstance(state, CallChannel):
            if not state.closed:
                return state
            self.channel_counters["channel_broken"] += 1
            self._channels[coordinator] = None  # broke: Ray calls from now on
        elif state is _UNASKED and not self._closed:
            self._channels[coordinator] = _OPENING
            self._spawn(self._open(coordinator))
        return None

    async def _open(self, coordinator: Any) -> None:
        try:
            address = await coordinator.submit_address.remote()
            channel = await connect(*address, {}, self.channel_counters) if address is not None else None
        except Exception as exc:  # an older coordinator, or its node unreachable: Ray calls
            self.channel_counters["channel_open_failed"] += 1
            log.debug("no submission channel to %r, Ray calls instead: %r", coordinator, exc)
            channel = None
        if self._closed or self._channels.get(coordinator) is not _OPENING:
            if channel is not None:
                channel.close()
            return
        self._channels[coordinator] = channel
        if channel is not None:
            self.channel_counters["channel_opened"] += 1

    def _keep(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _flush(self, coordinator: Any) -> None:
        batch = self._pending.pop(coordinator, [])
        if len(batch) == 1:
            self.counters["submit_calls"] += 1
            self._spawn(_one(coordinator, *batch[0]))
        elif batch:
            self.counters["submit_batches"] += 1
            self._spawn(_many(coordinator, batch))


_UNASKED, _OPENING = object(), object()
_OUTCOME = msgspec.msgpack.Decoder(str)


def _read_error(future: asyncio.Future[str]) -> None:
    if not future.cancelled():
        future.exception()


async def _one(coordinator: Any, request: SubmitRequest, future: asyncio.Future[str]) -> None:
    try:
        outcome = await coordinator.submit.remote(*request)
    except asyncio.CancelledError:  # the client is shutting down
        future.cancel()
        raise
    except Exception as exc:
        if not future.done():
            future.set_exception(exc)
    else:
        if not future.done():
            future.set_result(str(outcome))


async def _many(coordinator: Any, batch: list[tuple[SubmitRequest, asyncio.Future[str]]]) -> None:
    futures = [future for _, future in batch]
    try:
        async for ref in coordinator.submit_many.remote([request for request, _ in batch]):
            for answer in await ref:
                future = futures[answer.index]
                if future.done():
                    continue  # its caller stopped waiting
                if answer.error is not None:
                    future.set_exception(answer.error)
                else:
                    future.set_result(str(answer.outcome))
    except asyncio.CancelledError:  # the client is shutting down
        for future in futures:
            future.cancel()
        raise
    except Exception as exc:
        for future in futures:
            if not future.done():
                future.set_exception(exc)
    else:
        error = RuntimeError("submit_many ended without answering every request")
        for future in futures:
            if not future.done():
                future.set_exception(error)
